"""The lab: its files checked statically, then run as local processes with nginx and Prometheus."""
