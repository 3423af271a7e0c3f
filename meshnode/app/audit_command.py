"""``meshnode audit verify FILE``: check audit evidence offline, with nothing but the file.

Exit status: 0 the evidence convicts its accused; 1 it does not (a fault, or a hop with inexact
numerics only checked within tolerance); 2 the file cannot be read or is not evidence at all.
The checks are :mod:`meshnode.audit.evidence`'s; this module only reads the file and prints.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from meshnode.commandline.cli_error import CliError

EXIT_CONVICTED = 0
EXIT_NOT_EVIDENCE = 1
EXIT_UNREADABLE = 2


def run_verify(args: argparse.Namespace) -> int:
    # Imported here: the digests need numpy, which reading the command line must not load.
    from meshnode.audit.evidence import MAX_EVIDENCE_BYTES, EvidenceFault, verify_evidence_bytes

    path: Path = args.file
    try:
        with path.open("rb") as handle:
            # One byte over the limit is enough to refuse it; a larger file is never read whole.
            data = handle.read(MAX_EVIDENCE_BYTES + 1)
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror or error}", EXIT_UNREADABLE) from None
    verdict = verify_evidence_bytes(data)
    print(verdict.line())
    if verdict.convicted:
        return EXIT_CONVICTED
    return EXIT_UNREADABLE if verdict.fault is EvidenceFault.MALFORMED else EXIT_NOT_EVIDENCE


def register(subparsers: argparse._SubParsersAction, common: argparse.ArgumentParser) -> None:
    parser = subparsers.add_parser(
        "audit", parents=[common], help="audits of what members compute: check evidence"
    )
    actions = parser.add_subparsers(dest="audit_command", required=True, metavar="ACTION")
    verify = actions.add_parser(
        "verify",
        help="check an evidence file offline",
        description="Check that an evidence file convicts its accused: the accused's own signed "
        "commitment against two other nodes' agreeing ones for the same input. Needs no mesh.",
    )
    verify.add_argument("file", type=Path, metavar="FILE", help="the evidence file (JSON)")
    verify.set_defaults(handler=run_verify)


__all__ = ["EXIT_CONVICTED", "EXIT_NOT_EVIDENCE", "EXIT_UNREADABLE", "register", "run_verify"]
