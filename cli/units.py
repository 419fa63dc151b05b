"""Numbers for people."""


def human_bytes(size: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as llama.cpp prints them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"
