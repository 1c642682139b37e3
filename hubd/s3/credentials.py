"""Where hubd finds its S3 keys: the places every S3 tool looks, in the AWS CLI's order.

1. ``AWS_ACCESS_KEY_ID`` + ``AWS_SECRET_ACCESS_KEY`` (+ ``AWS_SESSION_TOKEN``) in the
   environment. One of the pair without the other is an error, not a fall-through: a
   half-set environment is a mistake the user wants to hear about.
2. The profile ``AWS_PROFILE`` names (else ``default``) in the shared credentials file
   (``AWS_SHARED_CREDENTIALS_FILE``, else ``~/.aws/credentials``), then in the config file
   (``AWS_CONFIG_FILE``, else ``~/.aws/config``, where the section is ``[profile NAME]``,
   or ``[default]``). A profile named by ``AWS_PROFILE`` that exists nowhere is an error.

Role assumption, SSO, ``credential_process`` and instance metadata are not read: a profile
that holds no static keys is reported as such, in one line naming what to set instead.
Every failure is a ``CredentialsError`` whose message is one line naming the files looked
in, and never quotes a secret.
"""

from __future__ import annotations

import configparser
import os
from collections.abc import Mapping
from pathlib import Path

from hubd.s3.sigv4 import Credentials

__all__ = ["CredentialsError", "find_credentials"]

_ENV_HINT = "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or AWS_PROFILE"


class CredentialsError(Exception):
    """No usable S3 keys; the message is one line for the user."""


def _file(env: Mapping[str, str], var: str, default: str) -> Path:
    return Path(os.path.expanduser(env.get(var) or default))


def _read_ini(path: Path) -> configparser.RawConfigParser | None:
    """The parsed file, or None if it does not exist."""
    parser = configparser.RawConfigParser(default_section="\0none")  # no DEFAULT magic
    try:
        with path.open(encoding="utf-8") as f:
            parser.read_file(f)
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as exc:
        why = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise CredentialsError(f"cannot read {path}: {why}") from None
    except configparser.Error as exc:
        line = str(exc).splitlines()[0]
        raise CredentialsError(f"cannot parse {path}: {line}") from None
    return parser


def _from_section(parser: configparser.RawConfigParser, section: str,
                  where: str) -> Credentials | None:
    """The keys of one section; None if it does not exist."""
    if not parser.has_section(section):
        return None
    values = parser[section]
    key_id = values.get("aws_access_key_id", "").strip()
    secret = values.get("aws_secret_access_key", "").strip()
    token = values.get("aws_session_token", "").strip() or None
    if key_id and secret:
        return Credentials(key_id, secret, token, where)
    if key_id or secret:
        missing = "aws_secret_access_key" if key_id else "aws_access_key_id"
        raise CredentialsError(f"{where} has no {missing}")
    raise CredentialsError(f"{where} holds no static keys (aws_access_key_id and "
                           f"aws_secret_access_key); roles, SSO and credential_process "
                           f"are not supported: {_ENV_HINT}")


def _from_env(env: Mapping[str, str]) -> Credentials | None:
    key_id = env.get("AWS_ACCESS_KEY_ID", "")
    secret = env.get("AWS_SECRET_ACCESS_KEY", "")
    if not key_id and not secret:
        return None
    if not key_id or not secret:
        missing = "AWS_SECRET_ACCESS_KEY" if key_id else "AWS_ACCESS_KEY_ID"
        raise CredentialsError(f"{missing} is not set (the other half of the key pair is)")
    return Credentials(key_id, secret, env.get("AWS_SESSION_TOKEN") or None, "environment")


def find_credentials(env: Mapping[str, str] | None = None) -> Credentials:
    """The S3 keys to sign with, from ``env`` (default: ``os.environ``) and the AWS files.

    Raises:
        CredentialsError: none found, a half pair, an unknown ``AWS_PROFILE``, an
            unreadable or malformed file.
    """
    env = os.environ if env is None else env
    creds = _from_env(env)
    if creds is not None:
        return creds
    named = env.get("AWS_PROFILE") or None
    profile = named or "default"
    shared = _file(env, "AWS_SHARED_CREDENTIALS_FILE", "~/.aws/credentials")
    config = _file(env, "AWS_CONFIG_FILE", "~/.aws/config")
    parsed = _read_ini(shared)
    if parsed is not None:
        creds = _from_section(parsed, profile, f"profile {profile!r} in {shared}")
        if creds is not None:
            return creds
    parsed = _read_ini(config)
    if parsed is not None:
        section = "default" if profile == "default" else f"profile {profile}"
        creds = _from_section(parsed, section, f"profile {profile!r} in {config}")
        if creds is not None:
            return creds
    if named is not None:
        raise CredentialsError(f"AWS_PROFILE={profile} names no profile in {shared} or "
                               f"{config}")
    raise CredentialsError(f"no S3 credentials: {_ENV_HINT} (looked in the environment, "
                           f"{shared} and {config})")
