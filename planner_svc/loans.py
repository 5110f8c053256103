"""Pages and state slots lent out of one executor group's pools to an executor RPC that writes into them (a
restore), and the pools' epoch.

A lost executor rebuilds the pools (recovery.py) while such an RPC may still be answering; the executor may
even live on and still be writing. So the rebuilt pools keep every loan out (no request takes what it may
write), the RPC's owner gives its loan back into them whenever it answers, and an answer from an older epoch
is not trusted (what it wrote may be gone with the executor). Pure logic: no gRPC, no asyncio.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class Loan:
    pages: list[int]
    states: list[int]  # recurrent-state slots
    epoch: int  # the pools' epoch when lent


class Loans:
    """The loans out, and the epoch: how many times the pools were rebuilt."""

    def __init__(self) -> None:
        self.epoch = 0
        self._out: list[Loan] = []

    def lend(self, pages: list[int], states: list[int]) -> Loan:
        """Record pages and state slots the caller took from the pools, until `end`."""
        loan = Loan(pages, states, self.epoch)
        self._out.append(loan)
        return loan

    def end(self, loan: Loan) -> None:
        """The RPC answered: its pages and slots are the caller's again (to keep or to give back)."""
        self._out.remove(loan)

    @property
    def lending_states(self) -> bool:
        """A loan out holds state slots: they come back, or go to a conversation, when its RPC answers."""
        return any(loan.states for loan in self._out)

    def stale(self, loan: Loan) -> bool:
        """The pools were rebuilt since it was lent: what the RPC wrote cannot be trusted."""
        return loan.epoch != self.epoch

    def rebuilt(self) -> tuple[list[int], list[int]]:
        """The pools are rebuilt (an executor lost): a new epoch. Returns the pages and the state slots still
        out, which the rebuilt pools keep taken."""
        self.epoch += 1
        pages = [page for loan in self._out for page in loan.pages]
        states = [slot for loan in self._out for slot in loan.states]
        return pages, states
