"""The warning run and chat print before templating a chat for a base model (models.yaml
`base: true`, cli/store/registry.py model_kind): it only continues text, so the reply is noise."""

from __future__ import annotations


def warn_if_base(
    name: str | None, continue_with: str = "`quill run --raw` gives it text to continue"
) -> None:
    """One warning line when `name` (None: the default model) is a base model; else nothing."""
    from cli.store.config import default_model
    from cli.store.registry import load_registry, registry_entry

    registry = load_registry()
    entry = registry_entry(name or default_model(), registry)
    if entry is None or not entry.base:
        return
    from cli.ui import render

    chat_models = [alias for alias, e in registry.models.items() if not e.base]
    instead = registry.default if registry.default in chat_models else next(iter(chat_models), "")
    render.warning_line(
        f"{entry.alias} is a base model, not instruction-tuned: it only continues text, so a chat "
        f"reply comes out as echoes and repeats; {continue_with}, or use an instruction-tuned "
        "model" + (f" such as {instead}" if instead else "")
    )
