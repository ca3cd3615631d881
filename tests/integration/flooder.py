"""A stranger at rank 0's rendezvous (test_scale.py, tests/bench/scale.py):
a DEALER that sends random bytes as joins, one at a time, each once the
refusal of the one before came back, until COUNT are sent, SECONDS have
passed, or no answer came for 3 s (the rendezvous is over).  Prints: sent
answered.  Run as `python3 -c "$(cat flooder.py)" COORD COUNT SECONDS`, so
that it needs no file a user such as nobody can read."""
import os
import sys
import time

import zmq

coord, count, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
s = zmq.Context().socket(zmq.DEALER)
s.setsockopt(zmq.LINGER, 0)
s.connect(coord)
sent = answered = 0
deadline = time.time() + seconds
while sent < count and time.time() < deadline:
    s.send(os.urandom(1 + sent % 1500))
    sent += 1
    if not s.poll(3000):
        break
    s.recv()
    answered += 1
print(sent, answered)
