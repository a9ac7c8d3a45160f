"""The database a command opens, and ``Refused``: the one line a command that cannot run prints.

Its own module so that the status readers (``status_reader``, ``status_client``) and the
commands that call them (``service_commands``) share these without importing each other.
"""

from __future__ import annotations


class Refused(Exception):
    """A command cannot run; its message is the one line the user sees."""


def open_database(url: str, *, check: bool = True):
    """The database at ``url``, its schema checked (``ensure_schema``), or ``Refused``."""
    from sqlalchemy import exc as sa_exc
    from sqlalchemy.engine import make_url

    from service.db import Database
    from service.migrate import SchemaNotCurrent, ensure_schema

    db = Database(url)
    try:
        if check:
            ensure_schema(db)
        else:
            db.ping()
    except SchemaNotCurrent as exc:
        db.dispose()
        raise Refused(str(exc)) from exc
    except (sa_exc.OperationalError, sa_exc.InterfaceError) as exc:
        db.dispose()
        where = make_url(url).render_as_string(hide_password=True)
        reason = str(getattr(exc, "orig", exc)).strip().splitlines()[0]
        raise Refused(f"cannot use the database {where}: {reason}") from exc
    return db
