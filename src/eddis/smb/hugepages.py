"""Huge pages for an smb-server's arena: what the node offers, what to ask for, what was got.

``SMB_HUGEPAGES`` chooses:

- ``off``: normal pages;
- ``hugetlb``: explicit huge pages (``vm.nr_hugepages``), required: the server
  refuses to start without enough of them;
- ``transparent``: transparent huge pages on the shared memory, required: refused
  when the kernel's ``shmem_enabled`` policy turns them off;
- ``auto``: hugetlb when the node has enough, else transparent when its policy
  allows, else normal pages with a warning that says how to get huge pages.

After the arena is mapped, :func:`arena_pages` reads ``/proc/self/smaps`` so the
server reports the pages it really holds, not the ones it asked for.
"""
import re

from .. import settings
from ..errors import ConfigError

MODES = settings.REGISTRY["SMB_HUGEPAGES"].choices   # the registry holds the list
MEMINFO = "/proc/meminfo"
SHMEM_POLICY = "/sys/kernel/mm/transparent_hugepage/shmem_enabled"
OVERCOMMIT = "/proc/sys/vm/nr_overcommit_hugepages"
# shmem_enabled values under which madvise(MADV_HUGEPAGE) gets huge pages
THP_POLICIES_ON = ("always", "within_size", "advise", "force")


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def hugetlb_facts(meminfo=MEMINFO, overcommit=OVERCOMMIT):
    """(page size in bytes, pages in the pool, free pages, overcommit pages) of the
    default hugetlb pool; page size 0 when the kernel has no hugetlb support."""
    text = _read(meminfo) or ""
    fields = dict(re.findall(r"^(\w+):\s+(\d+)", text, re.M))
    page = int(fields.get("Hugepagesize", 0)) * 1024
    total = int(fields.get("HugePages_Total", 0))
    free = int(fields.get("HugePages_Free", 0))
    extra = _read(overcommit)
    return page, total, free, int(extra) if extra and extra.strip().isdigit() else 0


def shmem_thp_policy(path=SHMEM_POLICY):
    """The kernel's transparent-huge-page policy for shared memory ('never' when unknown)."""
    text = _read(path)
    if not text:
        return "never"
    chosen = re.search(r"\[(\w+)\]", text)
    return chosen.group(1) if chosen else text.split()[0]


def _pages(nbytes, page):
    return (nbytes + page - 1) // page


def hugetlb_shortage(size, page, total, free, overcommit):
    """Why hugetlb cannot back `size` bytes (None when it may): names the sysctl to set,
    counting the pages other processes hold."""
    if page == 0:
        return "this kernel has no hugetlb pages"
    need = _pages(size, page)
    if free + overcommit >= need:
        return None
    return (f"{need} free {page >> 20} MiB hugetlb pages are needed and the node has {free} "
            f"(reserve them: sysctl -w vm.nr_hugepages={total - free + need}, as root, or at boot)")


def thp_refusal(policy):
    """Why transparent huge pages cannot back shared memory (None when they can)."""
    if policy in THP_POLICIES_ON:
        return None
    return (f"transparent huge pages are off for shared memory (shmem_enabled={policy}; "
            f"as root: echo advise > {SHMEM_POLICY})")


def plan(mode, size, facts=None, policy=None):
    """What to try for an arena of `size` bytes: ('hugetlb', page), ('transparent', 0) or
    ('off', 0), and a warning for ``auto`` that found nothing (else None). Explicit modes
    that the node cannot honour raise ConfigError naming the fix."""
    if mode not in MODES:
        raise ConfigError(f"SMB_HUGEPAGES={mode!r} is not one of {', '.join(MODES)}")
    if mode == "off":
        return ("off", 0), None
    facts = facts if facts is not None else hugetlb_facts()
    page = facts[0]
    policy = policy if policy is not None else shmem_thp_policy()
    no_hugetlb = hugetlb_shortage(size, *facts)
    no_thp = thp_refusal(policy)
    if mode == "hugetlb":
        if no_hugetlb:
            raise ConfigError(f"SMB_HUGEPAGES=hugetlb: {no_hugetlb}; or use SMB_HUGEPAGES=auto")
        return ("hugetlb", page), None
    if mode == "transparent":
        if no_thp:
            raise ConfigError(f"SMB_HUGEPAGES=transparent: {no_thp}; or use SMB_HUGEPAGES=auto")
        return ("transparent", 0), None
    if not no_hugetlb:
        return ("hugetlb", page), None
    if not no_thp:
        return ("transparent", 0), None
    return ("off", 0), (f"SMB_HUGEPAGES=auto found no huge pages, so the arena uses normal pages: "
                        f"{no_hugetlb}; {no_thp}")


def arena_pages(address, smaps="/proc/self/smaps"):
    """Page facts of the mapping that starts at `address`, from smaps: kernel page size,
    resident bytes, bytes mapped by huge pages (explicit or transparent). None if absent."""
    text = _read(smaps)
    if text is None:
        return None
    want = f"{address:x}-"
    found = None
    for line in text.splitlines():
        if re.match(r"^[0-9a-f]+-[0-9a-f]+ ", line):
            if found is not None:
                break
            if line.startswith(want):
                found = {}
            continue
        if found is not None:
            key, _, rest = line.partition(":")
            value = rest.split()
            if len(value) == 2 and value[1] == "kB":
                found[key] = int(value[0]) * 1024
    if found is None:
        return None
    kernel_page = found.get("KernelPageSize", 4096)
    resident = found.get("Rss", 0)
    huge = resident if kernel_page > 4096 else found.get("ShmemPmdMapped", 0)
    return {"kernel_page_size": kernel_page, "resident": resident, "huge": huge}


def describe(kind, page, pages):
    """One line for the server's log: what backs the arena."""
    if kind == "hugetlb":
        text = f"explicit huge pages of {page >> 20} MiB (hugetlb)"
        if pages is not None and pages["kernel_page_size"] != page:
            text += f", but the kernel maps it with {pages['kernel_page_size'] >> 10} KiB pages"
        return text
    if kind == "transparent":
        held = "" if pages is None else f", {pages['huge'] >> 20} MiB of them resident now"
        return f"transparent huge pages where the kernel can (shmem_enabled={shmem_thp_policy()}{held})"
    return "normal pages"


__all__ = ["MODES", "plan", "arena_pages", "hugetlb_facts", "shmem_thp_policy", "describe"]
