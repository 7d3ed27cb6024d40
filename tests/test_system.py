"""prl.system: what every process asks of the OS and the interpreter."""

import subprocess
import sys


def test_freeze_heap_takes_what_lives_out_of_full_passes():
    """`freeze_heap` (each process, once started): garbage cycles alive before it are freed, not frozen; what
    else was alive is out of the collector's passes; a cycle made afterwards is still collected. In a child
    process: the freeze would otherwise outlive this test."""
    code = """
import gc, weakref
from prl.system import freeze_heap
class Node: pass
before = Node(); before.me = before; dead = weakref.ref(before); del before
alive = len(gc.get_objects())
freeze_heap()
assert dead() is None, "a garbage cycle was frozen instead of freed"
assert gc.get_freeze_count() >= alive * 0.9, (gc.get_freeze_count(), alive)
assert len(gc.get_objects()) < alive * 0.1
a = []; a.append(a); del a
assert gc.collect() >= 1
print("ok")
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
