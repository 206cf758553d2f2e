#!/bin/bash
# Run the Spack steps of docs/install.md ("With Spack") as a site admin would, with every
# path in a scratch directory instead of /opt, /srv and /tmp.
#
# Each bash or yaml block of that section is a step, marked in the page by a comment
# `<!-- spack-guide: NAME -->` above it. This script runs the steps in the order of STEPS,
# each as written, but for:
#   - the variables the blocks set on a line of their own (PYDEPS=, SITE_GIT=, SCRATCH=,
#     SPACK_ROOT=, SPACK_PACKAGES=), which get the values below; in a yaml block, their
#     documented values are replaced by the same;
#   - <checkout> (this checkout) and <commit> (its HEAD, tagged as the release);
#   - a command whose line ends in `# refused: TEXT`, which must fail and print TEXT;
#   - a yaml block, a `packages:` fragment, which is added to the packages.yaml of the check.
# tests/test_spack_recipe.py checks that every block of the section is a step and that the
# steps make a valid bash program (--print); it does not run them (no Spack in CI).
#
# Usage:
#   SPACK_ROOT=DIR SPACK_PACKAGES=DIR TORCH_CPU_INDEX=URL scripts/check-spack-guide.sh [--print] [SCRATCH]
#     SPACK_ROOT       a copy of Spack (checked: spack/spack at the tag v1.1.0)
#     SPACK_PACKAGES   a copy of its builtin packages (checked: spack/spack-packages at v2025.11.0)
#     TORCH_CPU_INDEX  PyTorch's CPU wheel index (the --index-url pytorch.org's install selector
#                      gives for Linux, Pip, CPU), or a local index holding the same wheel
#     SCRATCH          where everything goes (default: a new directory under /tmp); removed
#                      by nobody, so that the install can be inspected afterwards
#     --print          print the program instead of running it
# Needs a Debian 12 machine with the packages of "Debian 12" installed, pip's package index,
# and time: on 2 busy cores about 40 minutes, most of it mpi4py's build and Spack's solver.
# Run it niced (nice -n 19): the config it writes asks Spack for one build job.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
GUIDE=$REPO/docs/install.md
STEPS="spack-setup site-copy externals site-copy-yaml quick-start variants"

PRINT=0
if [ "${1:-}" = "--print" ]; then PRINT=1; shift; fi
SCRATCH=${1:-}
if [ -z "$SCRATCH" ]; then
    if [ $PRINT = 1 ]; then SCRATCH=/tmp/eddis-spack-guide.XXXX; else SCRATCH=$(mktemp -d /tmp/eddis-spack-guide.XXXX); fi
fi

program() {
    /usr/bin/python3 - "$GUIDE" "$REPO" "$SCRATCH" "$STEPS" <<'END'
import re
import subprocess
import sys

guide, repo, scratch, steps = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4].split()
text = open(guide).read()
blocks = {}
for m in re.finditer(r"<!-- spack-guide: ([\w-]+) -->\n+```(\w+)\n(.*?)\n```", text, re.S):
    if m.group(1) in blocks:
        sys.exit(f"{guide}: step {m.group(1)} is marked twice")
    blocks[m.group(1)] = (m.group(2), m.group(3))
missing = [s for s in steps if s not in blocks]
extra = [s for s in blocks if s not in steps]
if missing or extra:
    sys.exit(f"{guide} and {sys.argv[0]} disagree: steps not in the page {missing}, steps not run {extra}")

values = {"PYDEPS": f"{scratch}/eddis-pydeps", "SITE_GIT": f"{scratch}/eddis-src.git",
          "SCRATCH": f"{scratch}/spack", "SPACK_ROOT": "${SPACK_ROOT:?set SPACK_ROOT to a copy of Spack}",
          "SPACK_PACKAGES": "${SPACK_PACKAGES:?set SPACK_PACKAGES to a copy of spack-packages}"}
documented = {}  # the value each variable has in the page, for the yaml blocks
commit = subprocess.run(["git", "-C", repo, "rev-parse", "HEAD"], capture_output=True, text=True,
                        check=True).stdout.strip()
out = ["set -euo pipefail",
       ': "${TORCH_CPU_INDEX:?set TORCH_CPU_INDEX to PyTorch CPU wheel index (see the usage)}"',
       "refused() {  # refused TEXT COMMAND...: the command fails, saying TEXT",
       '    local text=$1 output; shift',
       '    if output=$("$@" 2>&1); then echo "$output"; echo "check-spack-guide: expected a refusal: $*" >&2; exit 1; fi',
       '    grep -qF -- "$text" <<<"$output" || { echo "$output"; echo "check-spack-guide: refused without: $text" >&2; exit 1; }',
       '    echo "refused, as the guide says: $text"',
       "}"]
for step in steps:
    lang, body = blocks[step]
    out.append(f"\necho '=== step {step}' \"($(date +%T))\"")
    if lang == "yaml":
        lines = body.splitlines()
        if lines[0] != "packages:":
            sys.exit(f"{guide}: yaml step {step} must be a packages: fragment")
        fragment = "\n".join(lines[1:])
        for name, value in documented.items():
            fragment = fragment.replace(value, values[name])
        out += ['cat >> "$SPACK_USER_CONFIG_PATH/packages.yaml" <<\'YAML\'', fragment, "YAML",
                'echo "added to $SPACK_USER_CONFIG_PATH/packages.yaml:"; sed -n \'$p\' "$SPACK_USER_CONFIG_PATH/packages.yaml"']
        continue
    out.append("set -x")
    for line in body.replace("<checkout>", repo).replace("<commit>", commit).splitlines():
        assignment = re.match(r"(\w+)=(\S+)(\s+#.*)?$", line)
        if assignment and assignment.group(1) in values:
            documented[assignment.group(1)] = assignment.group(2)
            line = f'{assignment.group(1)}="{values[assignment.group(1)]}"'
        refusal = re.match(r"(.*?)\s+# refused: (.*)$", line)
        if refusal:
            line = "refused '" + refusal.group(2).replace("'", "'\\''") + "' " + refusal.group(1)
        out.append(line)
    out.append("{ set +x; } 2>/dev/null")
out.append("\necho '=== check-spack-guide: every step ran as the guide says'")
print("\n".join(out))
END
}

if [ $PRINT = 1 ]; then
    program
    exit 0
fi
PROGRAM=$(program)
mkdir -p "$SCRATCH"
echo "check-spack-guide: steps of $GUIDE in $SCRATCH (log: $SCRATCH/check.log)"
# shellcheck disable=SC2016
bash -c "$PROGRAM" 2>&1 | tee "$SCRATCH/check.log"
exit "${PIPESTATUS[0]}"
