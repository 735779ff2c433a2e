"""Capture of flagged steps and their post-mortem replay.

    snapshot.py  start-of-step state kept in a ring of preallocated buffers (hot path)
    manager.py   decides when an alert writes a bundle; sets Alert.capture
    writer.py    bundle on disk: atomic, checksummed, retention limits
    reader.py    verifies and loads a bundle; never executes code from it, never follows a link
    trust.py     what replay may import and call: only names the user gives or confirms
    replay.py    re-runs the step: reproduction, fp64 comparison, --upcast what-if

This package's __init__ imports nothing: config.py imports capture.policy, and the heavier
modules import the monitor, so eager imports here would be circular.
"""
