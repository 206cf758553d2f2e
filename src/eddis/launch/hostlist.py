"""Slurm's compact host lists and task counts, parsed without calling Slurm.

``n[1-3,7],gpu01`` -> ``['n1', 'n2', 'n3', 'n7', 'gpu01']`` and
``2(x3),1`` -> ``[2, 2, 2, 1]``: the formats of ``SLURM_*NODELIST*`` and
``SLURM_*TASKS_PER_NODE*``. Pure functions, so the launcher can map a rank's
environment without a round trip to slurmctld.
"""
from ..errors import ConfigError


def _split_top_level(text):
    """Split on commas that are not inside brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"host list {text!r} has an unmatched ']'")
        elif ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    if depth != 0:
        raise ConfigError(f"host list {text!r} has an unmatched '['")
    parts.append(text[start:])
    return [p for p in parts if p]


def _expand_ranges(body, text):
    values = []
    for item in body.split(","):
        if "-" in item:
            lo, hi = item.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()) or int(hi) < int(lo):
                raise ConfigError(f"host list {text!r}: bad range {item!r}")
            width = len(lo)
            values.extend(str(v).zfill(width) for v in range(int(lo), int(hi) + 1))
        elif item.isdigit():
            values.append(item)
        else:
            raise ConfigError(f"host list {text!r}: bad range item {item!r}")
    return values


def _expand_one(name, text):
    open_at = name.find("[")
    if open_at < 0:
        return [name]
    close_at = name.index("]", open_at)
    prefix, body, rest = name[:open_at], name[open_at + 1:close_at], name[close_at + 1:]
    return [prefix + value + tail
            for value in _expand_ranges(body, text)
            for tail in _expand_one(rest, text)]


def expand_hostlist(text):
    """Expand a Slurm host list expression into host names, in order."""
    text = (text or "").strip()
    if not text or text == "(null)":
        return []
    hosts = []
    for part in _split_top_level(text):
        hosts.extend(_expand_one(part, text))
    return hosts


def expand_tasks_per_node(text):
    """Expand ``2(x3),1`` (SLURM_TASKS_PER_NODE format) into ``[2, 2, 2, 1]``."""
    counts = []
    for item in (text or "").split(","):
        item = item.strip()
        if not item:
            continue
        try:
            if "(x" in item:
                count, repeat = item.rstrip(")").split("(x")
                counts.extend([int(count)] * int(repeat))
            else:
                counts.append(int(item))
        except ValueError:
            raise ConfigError(f"tasks-per-node list {text!r}: bad item {item!r}") from None
    return counts
