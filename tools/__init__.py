"""Tooling beside the library, neither shipped in the package nor a paper study (tools/device/)."""
