"""The Python package's layout check (python/kvferry, _abi_check): it loads against this build's
libkvferry, whose kvf_abi_info agrees with every field and constant it repeats; and it refuses,
with an ImportError naming both versions, a library that reports another ABI
($KVFERRY_TEST_LIBRARY_ABI), one whose struct differs, and one that reports nothing."""
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = dict(os.environ, PYTHONPATH=os.path.join(ROOT, "python"))


def fail(msg):
    print("FAIL python_abi_test: " + msg)
    sys.exit(1)


def run(code, **extra):
    return subprocess.run([sys.executable, "-c", code], env=dict(ENV, **extra),
                          capture_output=True, text=True, timeout=60)


ok = run("import kvferry; print(kvferry.ABI, kvferry._lib.kvf_abi_info(b'abi'), "
         "kvferry._lib.kvf_abi_info(b'sizeof kvf_event'))")
if ok.returncode != 0:
    fail("import against this build: " + ok.stderr.strip())
abi, lib_abi, ev_size = ok.stdout.split()
if abi != lib_abi or ev_size != "560":
    fail("package ABI %s, library ABI %s, event of %s bytes" % (abi, lib_abi, ev_size))

bad = run("import kvferry", KVFERRY_TEST_LIBRARY_ABI="2")
err = bad.stderr.strip().splitlines()[-1] if bad.stderr.strip() else ""
if bad.returncode == 0 or "ImportError" not in err or "ABI 1" not in err or "ABI 2" not in err \
        or "libkvferry.so.0" not in err:
    fail("a library of ABI 2 was not refused with both versions named: %r" % err)

# A struct that differs, and a library that reports nothing (one without kvf_abi_info).
probe = run(r'''
import kvferry
real = lambda name: (lambda v: None if v < 0 else int(v))(kvferry._lib.kvf_abi_info(name.encode()))
moved = lambda name: 24 if name == "offsetof kvf_event.peer" else real(name)
for info, want in ((moved, "offsetof kvf_event.peer: 148 here, 24 there"), (lambda n: None, "ABI unknown")):
    try:
        kvferry._abi_check(info, "libkvferry.so.0", "9.9.9")
        print("accepted")
    except ImportError as e:
        print("refused" if want in str(e) and "ABI 1" in str(e) else "unclear: %s" % e)
''')
if probe.returncode != 0 or probe.stdout.split() != ["refused", "refused"]:
    fail("layout mismatch not refused clearly: %r %r" % (probe.stdout, probe.stderr))
print("PASS python_abi_test: loads against ABI %s; another ABI, a moved field and a silent "
      "library refused: %s" % (abi, err))
