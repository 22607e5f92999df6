"""Settings for the whole suite: under CI no test skips silently (tests/ci_skips.py).

A suite started in the background of a script (`bash scripts/test &`, a CI runner's job)
inherits SIGINT ignored (POSIX: a background command of a non-interactive shell ignores it),
and so would every herd it starts: the Ctrl-C tests would send a signal nobody sees. Catching
it here gives every child the default again (an exec resets a caught signal, not an ignored one).
"""

import signal

if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)

pytest_plugins = ["tests.ci_skips"]
