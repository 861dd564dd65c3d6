"""tokenweir gateway: multi-tenant OpenAI-compatible admission control in front of engine pools."""
