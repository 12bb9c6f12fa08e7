"""One scrape target per ``preble serve``: the public metrics port serves the router's
server's series and every engine server's, each engine's labelled ``engine``, as a
Prometheus federation would. The engine servers' own endpoints stay (loopback, and the
file_sd file ``preble serve`` writes) for those who scrape them one by one.

Families are merged by name (Triton's ``nv_*`` families appear in every server): each
family's HELP and TYPE once, then its samples from every source. A source that does not
answer is left out, with a comment naming it, rather than failing the scrape.
"""

from __future__ import annotations

import asyncio
import re
from dataclasses import dataclass, field

SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})?(\s.*)$")
SUFFIXES = ("_bucket", "_sum", "_count", "_created", "_total")


@dataclass
class Family:
    help: str = ""
    type: str = ""
    samples: list[str] = field(default_factory=list)


def merge(sources: list[tuple[str | None, str]]) -> str:
    """``sources``: (engine name, or None for the router's server; its /metrics text)."""
    families: dict[str, Family] = {}
    notes = []
    for engine, text in sources:
        for line in text.splitlines():
            if line.startswith("# HELP ") or line.startswith("# TYPE "):
                kind, name, rest = line[2:6], *(line[7:].split(" ", 1) + [""])[:2]
                family = families.setdefault(name, Family())
                if kind == "HELP" and not family.help:
                    family.help = rest
                elif kind == "TYPE" and not family.type:
                    family.type = rest
            elif line.startswith("#"):
                notes.append(line)
            elif (found := SAMPLE.match(line)) is not None:
                name, labels, value = found.groups()
                if engine is not None:
                    inner = labels[1:-1] if labels else ""
                    labels = "{" + f'engine="{engine}"' + (f",{inner}" if inner else "") + "}"
                families.setdefault(_family_of(name, families), Family()).samples.append(
                    f"{name}{labels or ''}{value}"
                )
    out = list(notes)
    for name, family in families.items():
        if family.help:
            out.append(f"# HELP {name} {family.help}")
        if family.type:
            out.append(f"# TYPE {name} {family.type}")
        out.extend(family.samples)
    return "\n".join(out) + "\n"


def _family_of(sample: str, families: dict[str, Family]) -> str:
    if sample in families:
        return sample
    for suffix in SUFFIXES:
        if sample.endswith(suffix) and sample[: -len(suffix)] in families:
            return sample[: -len(suffix)]
    return sample


async def federate(session, router_url: str, engines: dict[str, str], timeout_s: float = 2.0) -> str:
    """Fetch the router's server's metrics and each engine's (``engines``: name -> URL of
    its /metrics) at once, and merge them."""
    import aiohttp

    async def fetch(url: str) -> str | None:
        try:
            async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
                return await resp.text() if resp.status == 200 else None
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return None

    names = [None, *engines]
    texts = await asyncio.gather(fetch(router_url), *(fetch(url) for url in engines.values()))
    sources = [(name, text) for name, text in zip(names, texts) if text is not None]
    missing = [name or "the router's server" for name, text in zip(names, texts) if text is None]
    merged = merge(sources)
    return "".join(f"# preble: {m} did not answer\n" for m in missing) + merged
