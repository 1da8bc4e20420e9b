"""Imported once by the forkserver that ``recsys-dist train`` forks its CPU ranks from (its
preload list, :data:`recsys_dist.train.launch.RANK_PRELOAD`): ``kill -USR1`` dumps stacks there.

A rank inherits the server's signal handlers when it is forked, so the dump is armed in the rank
from its first instruction, before its own code re-arms it; without this, a SIGUSR1 sent in that
window (a test harness asking a slow-starting run where it waits) ends the rank.
"""

from recsys_dist.logs import dump_stacks_on_sigusr1

dump_stacks_on_sigusr1()
