"""One folder per model family. The registry (``lmms_models._registry``) imports each folder on
first use, on its own: a family whose optional dependency is missing or broken fails alone."""
