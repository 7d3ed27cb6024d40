"""The terminal dashboard and `prl status`: one event-log fold, one renderer."""
