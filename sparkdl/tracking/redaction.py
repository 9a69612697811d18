"""Secrets out of what sparkdl prints and logs: URIs' passwords and query-string credentials, the
values of options and --conf keys whose names say secret, and free text that carries either.

Standard library only (`sparkdl submit` uses it before anything heavy is imported). One rule set for
every place that echoes user input: MLflow params, tags and text artifacts (failure.txt, the rank-0
log), the spark-submit command line `sparkdl submit` prints.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

MASK = "***"
# Words that make a name (an option, a --conf key, a query parameter) secret. "key" alone also masks an
# access key id (fs.s3a.access.key) or a keyStore path: too broad a mask costs a log line, too narrow a leak.
SECRET_WORDS = frozenset({"password", "passwd", "pwd", "secret", "secrets", "token", "credential", "credentials",
                          "apikey", "key", "sig", "signature", "authorization", "passphrase"})
_WORD = re.compile(r"[A-Z]?[a-z0-9]+|[A-Z]+(?![a-z])")

# scheme://user:password@host: the password runs to the authority's last '@' (so a password holding
# '@' is masked whole: Arrow and Hadoop accept s3://key:p@ss@bucket with the '@' unescaped), '/'
# included (an AWS secret key often holds one); a port (host:8080/a@b) is no password.
_URL_PASSWORD = re.compile(r"(?P<head>[a-zA-Z][\w+.-]*://[^:/@\s?#]*):(?!\d*(?:[/?#\s]|$))(?P<password>[^\s?#]*)@"
                           r"(?=[^@/\s?#]*(?:[/\s?#'\"]|$))")
# ?account_key=...&sig=... and the like in URIs, and key=value / key: value pairs in free text.
_QUERY_SECRET = re.compile(r"(?P<head>[?&;](?P<name>[\w.%-]+)=)(?P<value>[^&;\s#'\"]*)")
# name=value, name: value, and quoted names as in a dict's repr or JSON ({'password': 'x'}).
_TEXT_SECRET = re.compile(r"(?i)(?P<head>(?P<quote>['\"]?)\b(?P<name>[\w.-]*(?:" + "|".join(sorted(SECRET_WORDS)) +
                          r")[\w.-]*)(?P=quote)\s*[=:]\s*)(?P<value>'[^']*'|\"[^\"]*\"|[^\s,;&'\"}]+)")
# Credentials that say what they are without a name before them: AWS access key ids, Databricks,
# GitHub and Hugging Face tokens, and a bearer token anywhere in a line.
_BARE_CREDENTIAL = re.compile(r"\b(?:(?:AKIA|ASIA)[A-Z0-9]{16}|dapi[0-9a-f]{32}(?:-\d+)?|gh[pousr]_[A-Za-z0-9]{36,}"
                              r"|github_pat_\w{22,}|hf_[A-Za-z0-9]{30,})\b")
_BEARER = re.compile(r"(?P<head>\bBearer\s+)(?P<value>[\w.~+/-]+=*)")
# An Authorization header's value is a scheme and its credentials ("Bearer abc"): masked to the line's end.
_AUTHORIZATION = re.compile(r"(?i)(?P<head>\b(?:proxy-)?authorization['\"]?\s*[=:]\s*['\"]?)(?P<value>[^\r\n'\"]+)")


def is_secret_name(name: str) -> bool:
    """An option, --conf key or query parameter whose value must not be shown: one of its words
    (split at '.', '_', '-' and camelCase: AWSAccessKeyId, fs.azure.account.key.x) says secret."""
    return any(word.lower() in SECRET_WORDS for word in _WORD.findall(name))


def redact_text(text: str) -> str:
    """`text` with URL passwords, credential query parameters, secret-named key=value pairs, bearer
    tokens and self-describing credentials (AKIA..., dapi..., ghp_..., hf_...) masked. The one rule
    for MLflow's copies and for every SparkdlError's own text (sparkdl/errors.py)."""
    text = _URL_PASSWORD.sub(lambda m: f"{m['head']}:{MASK}@", text)
    text = _QUERY_SECRET.sub(lambda m: f"{m['head']}{MASK}" if is_secret_name(m["name"]) else m[0], text)
    text = _AUTHORIZATION.sub(lambda m: f"{m['head']}{MASK}", text)
    text = _BEARER.sub(lambda m: m[0] if m["value"] == MASK else f"{m['head']}{MASK}", text)
    text = _BARE_CREDENTIAL.sub(MASK, text)
    return _TEXT_SECRET.sub(_masked_pair, text)


def _masked_pair(match: re.Match[str]) -> str:
    value = match["value"]
    if not _secret_in_text(match["name"], value):
        return match[0]
    quote = value[0] if value[:1] in ("'", '"') else ""  # a JSON text stays JSON
    return f"{match['head']}{quote}{MASK}{quote}"


def _secret_in_text(name: str, value: str) -> bool:
    # "KeyError: 'x'" is an exception's name and its message, not a key and its value; a traceback's
    # source line (key = self._keys[i], sig = inspect.signature(f)) is code, not a secret.
    if not is_secret_name(name) or value.strip("'\"") == MASK or name.endswith(("Error", "Exception", "Warning")):
        return False
    return not (any(c in value for c in "()[]") or value.startswith("self."))


def redact_value(name: str, value: Any) -> Any:
    """An option's value as it may be logged: masked whole when the name says secret, else a string
    with its URLs and free text redacted; other types unchanged."""
    if is_secret_name(name):
        return MASK
    return redact_text(value) if isinstance(value, str) else value


def redact_params(params: dict[str, Any]) -> dict[str, Any]:
    return {key: redact_value(key, value) for key, value in params.items()}


def redact_command(argv: Sequence[str]) -> list[str]:
    """A command line as it may be printed: `--conf k=v` / `--conf=k=v` / `-c k=v` values masked when
    k says secret, and every argument's URLs redacted."""
    shown: list[str] = []
    conf_next = False
    for arg in argv:
        if conf_next:
            shown.append(_redact_assignment(arg))
        elif arg.startswith("--conf="):
            shown.append("--conf=" + _redact_assignment(arg[len("--conf="):]))
        else:
            shown.append(redact_text(arg))
        conf_next = arg in ("--conf", "-c")
    return shown


def _redact_assignment(assignment: str) -> str:
    key, sep, value = assignment.partition("=")
    if sep and is_secret_name(key):
        return f"{key}={MASK}"
    return redact_text(assignment)
