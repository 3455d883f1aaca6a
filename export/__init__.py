"""edgespec.export: a model (GGUF or Hugging Face checkpoint) to an edgespec artifact.

Needs the export extra (torch, transformers); the runtime never imports it. The repository
keeps it in export/; it installs as edgespec.export (pyproject.toml, package-dir)."""
