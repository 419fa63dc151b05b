"""Numbers and values for people."""


def human_bytes(size: float) -> str:
    """1536 -> '1.5 KiB'; binary units, as llama.cpp prints them."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024:
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size:.1f} TiB"


def shortened(text: str, width: int = 80) -> str:
    """text, cut to width characters with "..." when longer: a value a user typed, in a message."""
    return text if len(text) <= width else text[: width - 3] + "..."
