"""``eddis prof``: merge timelines, report profiles.

    eddis prof merge DIR [-o OUT]          one trace of every rank and server (Perfetto)
    eddis prof report RUN.h5|RUN_DIR [--out DIR] [--skip N] [--no-plots] [--json]

Also runnable as ``python -m eddis.timeline.cli ...``.
"""
import argparse
import json
import sys


def add_arguments(prof):
    """The ``eddis prof`` arguments (``eddis.cli`` SUBCOMMANDS protocol)."""
    sub = prof.add_subparsers(dest="prof_command", metavar="{merge,report}")
    sub.required = True
    merge = sub.add_parser("merge", help="merge the per-rank/server traces of a timeline directory")
    merge.add_argument("directory", help="the EDDIS_TIMELINE directory of a run")
    merge.add_argument("-o", "--output", help="output trace (default: DIR/timeline.json)")
    merge.set_defaults(func=_merge)
    rep = sub.add_parser("report", help="summary table and plots of a run's profile")
    rep.add_argument("profile", help="profile.h5 of a run, or its run directory")
    rep.add_argument("--out", help="directory for the PNG plots (default: next to the profile, report/)")
    rep.add_argument("--skip", type=int, default=None, help="warm-up steps to leave out (default: 1)")
    rep.add_argument("--no-plots", action="store_true", help="print the table only")
    rep.add_argument("--json", action="store_true", help="print the summary as JSON instead of a table")
    rep.set_defaults(func=_report)


def run(args):
    return args.func(args)


def _merge(args):
    from .merge import merge_timeline

    try:
        path, summary = merge_timeline(args.directory, args.output)
    except FileNotFoundError as exc:
        print(f"eddis prof merge: {exc}", file=sys.stderr)
        return 1
    unc = summary["max_uncertainty_us"]
    print(f"wrote {path}: {summary['events']} events from {len(summary['ranks'])} ranks "
          f"{summary['ranks']} and {len(summary['servers'])} servers {summary['servers']}; "
          f"clock alignment uncertainty at most "
          f"{'unknown (wall clock)' if unc is None else f'{unc:.1f} us'}. Open it in Perfetto or chrome://tracing.")
    return 0


def _report(args):
    from .report import report

    try:
        text, summary, paths = report(args.profile, out_dir=args.out, skip=args.skip, plots=not args.no_plots)
    except (FileNotFoundError, ValueError, OSError) as exc:
        print(f"eddis prof report: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(dict(summary, plots=[str(p) for p in paths]), indent=1))
    else:
        print(text)
        for p in paths:
            print(f"plot: {p}")
    return 0


def main(argv=None):
    parser = argparse.ArgumentParser(prog="eddis prof", description="Merge timelines and report training profiles.")
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
