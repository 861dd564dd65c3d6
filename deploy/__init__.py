"""The lab: config rendering (render.py), the local-process topology (lab.py), the dashboard picture."""
