"""What routes depend on, shared by the inference routes (server/) and the admin API (admin/) so that neither imports
the other: the app's `Services` and the callers' keys."""
