"""`import stabilitywatch` stays light: it does not import torch._dynamo (about 1 s), and the
monitor's own stand-in for torch.compiler.assume_constant_result marks a method as torch's does."""
from __future__ import annotations

import subprocess
import sys

import torch

from stabilitywatch.hooks.taps import assume_constant
from stabilitywatch.monitor import Monitor


def test_the_package_import_leaves_dynamo_unimported():
    code = ("import sys, stabilitywatch, stabilitywatch.cli; "
            "print('torch._dynamo' in sys.modules, 'numba' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["False", "False"], out


def test_assume_constant_marks_a_function_as_torch_does():
    def ours():
        return 1

    def theirs():
        return 1

    assume_constant(ours)
    torch.compiler.assume_constant_result(theirs)
    assert vars(ours) == vars(theirs) != {}
    assert vars(Monitor._traced_slot) == vars(theirs)
