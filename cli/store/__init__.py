"""Where models come from and where they live: the registry, sources, manifest, files."""
