"""`python tests/swarm/anchor_hooks.py hetnode-args...`: the hetnode CLI with one fault a test needs and
production code has no flag for: the anchor announces twice the inner steps (and tokens) it took, and says
on stderr what it really took (`overclaim: round R took N steps`); its record claims that its floor of steps
takes a day (`floor_s`), to stretch every round."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from hetnode.cli.main import main  # noqa: E402
from hetnode.daemon import anchor  # noqa: E402

_announce = anchor.AnchorLoop._announce


def overclaim(self: anchor.AnchorLoop, trained):  # noqa: ANN001, ANN202
    announcement, record = _announce(self, trained)
    print(f"overclaim: round {trained.round} took {trained.steps} steps", file=sys.stderr, flush=True)
    doubled = {**announcement, "steps": 2 * announcement["steps"], "tokens": 2 * announcement["tokens"]}
    return doubled, record


anchor.AnchorLoop._announce = overclaim
anchor.AnchorLoop._floor_s = lambda self, training: 86400.0  # noqa: ARG005

if __name__ == "__main__":
    sys.exit(main())
