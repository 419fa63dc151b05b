"""llama-server's slot actions (POST /slots/{id}?action=save|restore|erase), on quill's KV store:
a slot's sequence saved under a name is an entry of the store like any other (bounded with it,
listed and cleared by quill cache), and the name a small file beside the entries; restore loads
it into an idle slot of the model the request names (the first loaded, or the default)."""

from __future__ import annotations

from http import HTTPStatus
from typing import Any

from cli.api.pool import ModelPool
from cli.api.server import ApiError, bad_request
from cli.engine.batching import BatchScheduler, SlotBusyError, SlotStateNotFoundError
from cli.store.promptcache import SLOT_NAME

ACTIONS = ("save", "restore", "erase")


def slot_request(action: str | None, id_slot: str, body: dict) -> tuple[str, int, str | None]:
    """(action, slot, name) of a request, checked: one 400 for each thing wrong."""
    if action not in ACTIONS:
        raise bad_request("'action' must be save, restore or erase", "action")
    if not id_slot.isascii() or not id_slot.isdigit() or len(id_slot) > 6:
        raise bad_request(f"the slot must be a number, not {id_slot[:20]!r}", "id_slot")
    if action == "erase":
        return action, int(id_slot), None
    name = body.get("filename")
    if not isinstance(name, str) or not SLOT_NAME.fullmatch(name):
        raise bad_request(
            "'filename' must name the state: 1 to 128 letters, digits, '.', '_' or '-', "
            "not starting with '.'",
            "filename",
        )
    return action, int(id_slot), name


def slot_action(
    pool: ModelPool, model_name: str | None, action: str, index: int, name: str | None
) -> dict[str, Any]:
    """Run a checked slot action on the model's scheduler: llama-server's answer, or an
    ApiError (404 no such state, 409 the slot is busy, 501 no KV store)."""
    model = pool.acquire(model_name)
    try:
        scheduler = model.scheduler
        assert scheduler is not None  # acquired: loaded
        if not isinstance(scheduler, BatchScheduler):
            raise bad_request(f"{model.label} is an embedding model: it has no slots", "model")
        if action != "erase" and scheduler.store is None:
            raise ApiError(
                HTTPStatus.NOT_IMPLEMENTED,
                "slot save and restore keep states in the KV store, and this server was "
                "started without one",
            )
        if action == "save" and name is not None:
            return scheduler.save_slot(index, name)
        if action == "restore" and name is not None:
            return scheduler.restore_slot(index, name)
        return scheduler.erase_slot(index)
    except ValueError as error:
        raise bad_request(str(error), "id_slot") from None
    except SlotBusyError as error:
        raise ApiError(HTTPStatus.CONFLICT, str(error), "slot_busy") from None
    except SlotStateNotFoundError as error:
        raise ApiError(HTTPStatus.NOT_FOUND, str(error), "slot_state_not_found") from None
    except OSError as error:
        raise ApiError(HTTPStatus.INTERNAL_SERVER_ERROR, str(error)) from None
    finally:
        pool.release(model)
