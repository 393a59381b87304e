"""URLs in messages: a DVC remote's or an MLflow store's password never printed."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"(?P<s>\b[A-Za-z][\w+.-]*://)(?P<u>[^:/@\s]*):(?P<p>(?!\d+/)[^@\s]*)@")  # not host:port/path@x
_QUERY_SECRET = re.compile(r"(?P<k>[?&](?:[\w.-]*(?:password|passwd|pwd|secret|token|api_?key)[\w.-]*|pass)=)[^&#\s]*",
                           re.IGNORECASE)


def safe_uri(uri: str) -> str:
    """``uri`` (or any text holding URLs, e.g. an error message) with every password masked:
    ``postgresql://u:***@h:5432/db``, ``...?password=***``.

    The userinfo is read as SQLAlchemy reads it (``sqlalchemy/engine/url.py``: the password runs to
    the first ``@``), so a password with an unescaped ``#``, ``?`` or ``/`` is masked whole; a query
    parameter naming a password, secret, token or API key (libpq's ``?password=``) is masked too.
    """
    text = _USERINFO.sub(lambda m: f"{m['s']}{m['u']}:***@", uri)
    return _QUERY_SECRET.sub(lambda m: f"{m['k']}***", text)
