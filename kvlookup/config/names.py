"""Setting names for people who type them wrong: the closest setting to a name (``difflib``),
for an unknown ``KVLOOKUP_*`` variable (``KVLOOKUP_CHUNK_SIZE`` -> ``KVLOOKUP_HASH__CHUNK_SIZE``)
or YAML key (``chunk_size:`` -> ``hash.chunk_size``)."""

from __future__ import annotations

import difflib
from collections.abc import Iterable, Mapping

from kvlookup.config.options import ENV_PREFIX

#: ``KVLOOKUP_*`` variables read by scripts, tests and benchmarks, not settings.
NOT_SETTINGS = frozenset({
    "DATA_DIR", "STATUS_FILE", "CONFIG", "TRACE", "STAGE", "TEST_BACKENDS", "REAL_PEERS", "LMCACHE_PYTHON",
    "VLLM_PYTHON", "VLLM_SRC", "LMCACHE_VERSION", "REQUIRE_BROWSER", "SMOKE_INSTALL_DONE", "DASHBOARD_SCREENSHOT",
    "CHROMIUM", "CHROMEDRIVER", "CLUSTER_ADVERTISE_REPLY", "LMCACHE057_PYTHON", "DYNAMO_PYTHON", "OUTAGE_S",
    "OUTAGE_TTL_S", "COALESCE_WRITES", "FIRST_MISS", "BENCH_CACHE", "DYNAMO_N", "DYNAMO_ROUNDS",
    "LOOP_SKIP", "REQUIRE_NATIVE", "DYNAMO_DESIGNS", "MISS_LOOP", "BENCH_BASE", "MP_LOOP", "MP_COPY_DUTY",
})


def known(fields: Iterable[str], hash_keys: Iterable[str]) -> dict[str, str]:
    """lower-case name after the prefix -> how the setting is written (``hash.chunk_size``),
    from the settings' field names and the keys of ``hash``."""
    names = {name: name for name in fields if name != "hash"}
    names.update({f"hash__{key}": f"hash.{key}" for key in hash_keys})
    return names


def closest(name: str, settings: Mapping[str, str]) -> str | None:
    """The setting (``port``, ``hash.chunk_size``) whose name is nearest ``name``, or None.
    A bare hash key (``chunk_size``) is read as the hash setting it names. settings: :func:`known`."""
    if f"hash__{name}" in settings:
        return settings[f"hash__{name}"]
    match = difflib.get_close_matches(name, list(settings), n=1, cutoff=0.75)
    return settings[match[0]] if match else None


def env_name(setting: str) -> str:
    return ENV_PREFIX + setting.replace(".", "__").upper()


def unknown_env(env: Mapping[str, str], settings: Mapping[str, str]) -> list[str]:
    """One warning per ``KVLOOKUP_*`` variable that is no setting (and not one of NOT_SETTINGS).
    settings: :func:`known`."""
    out = []
    for key in sorted(env):
        if not key.startswith(ENV_PREFIX):
            continue
        name = key[len(ENV_PREFIX):]
        if name.lower() in settings or name in NOT_SETTINGS:
            continue
        near = closest(name.lower(), settings)
        hint = f"; did you mean {env_name(near)} ({near})?" if near else " (settings: docs/configuration.md)"
        out.append(f"{key} is not a kvlookup setting and is ignored{hint}")
    return out


def setting_hint(key: str, settings: Mapping[str, str]) -> str:
    """`` (did you mean hash.chunk_size?)`` for a YAML key that is no setting, or ``""``.
    settings: :func:`known`."""
    near = closest(str(key).lower(), settings)
    return f" (did you mean {near}?)" if near else ""
