"""What the scheduler decides over: sequences and their sampling parameters, the scheduler, the paged-KV block
manager, and the stats snapshots it reports."""
