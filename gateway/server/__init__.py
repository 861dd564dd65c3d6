"""The inference routes: thin routes, the fast lane, probes, `me`. The app that mounts them is gateway/app.py."""
