"""This release of Preble on Triton, in semantic versioning (docs/CHANGELOG.md says what
each release holds). pyproject.toml reads it from here; the banner of ``preble serve``, the
model card of ``/v1/models`` and ``/v2``'s server metadata say it."""

__version__ = "1.0.0"
