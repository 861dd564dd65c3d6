"""OpenAI batch jobs: input files checked (input_lines), each line run through the request path as its own request
(line_call), a batch run to its end by the replica holding its lease (job, runner), its output and error files
(output_lines), and the API's operations behind the thin routes of gateway/server/files.py and batches.py (service)."""
