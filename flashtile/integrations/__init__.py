"""Integrations of flashtile with other libraries (imported on demand, so flashtile itself does
not depend on them): ``flashtile.integrations.transformers``."""
