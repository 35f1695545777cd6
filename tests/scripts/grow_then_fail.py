"""An elastic job of 3 ranks that grows back (max_size 3) after launch rank 2 dies at step
10, then loses launch rank 1 at step 40, once the replacement has joined. With Open MPI
5.0.11 the survivors then may hang inside MPI while rebuilding their communicators
(docs/elastic.md, replacement limits); the job must end with an error saying so, or go on at 2
ranks, not hang."""

import os
import signal
import time

import numpy as np

import collectives as C
from collectives import elastic
from collectives.runtime import spawn

C.init()
LAUNCH_RANK = -1 if spawn.parent() is not None else C.rank()  # -1: a replacement
state = elastic.ObjectState(step=0)


full = False  # this process has run step 40 at 3 ranks (launch rank 1 died after it)


@elastic.run(max_size=3)
def train(state):
    global full
    while state.step < 80:
        if state.step == 40 and C.size() < 3 and not full:  # the replacement has not
            time.sleep(0.2)                                 # joined yet: wait for it
            state.commit()
            continue
        full = full or state.step == 40
        if (state.step, LAUNCH_RANK) in ((10, 2), (40, 1)):
            print(f"step {state.step}: launch rank {LAUNCH_RANK} dies", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        C.allreduce(np.ones(4))
        time.sleep(0.05)
        state.step += 1
        state.commit()


train(state)
print(f"launch rank {LAUNCH_RANK}: finished at {C.size()} ranks", flush=True)
