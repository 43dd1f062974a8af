"""Where the tests find Megatron-LM's sources: the snapshots of ``../shared/megatron-lm/<tag>``
beside the checkout (or the main checkout's, from a worktree), and the tags there."""

import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SNAPSHOTS = os.path.join(os.path.dirname(ROOT), "shared", "megatron-lm")
if not os.path.isdir(SNAPSHOTS):  # a worktree sits beside the main checkout
    SNAPSHOTS = "/work/shared/megatron-lm"
RELEASES = ("core_v0.16.1", "core_v0.19.0")
