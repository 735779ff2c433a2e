"""Which steps are sampled for which role, decided on the host from integers only."""
from __future__ import annotations

from .config import Config, Role


class Schedule:
    def __init__(self, config: Config):
        self.every = config.every
        self.warmup = config.warmup
        self.role_every = {Role(k): v for k, v in config.role_every.items()}
        self.roles = frozenset(config.roles)

    def roles_at(self, step: int) -> frozenset[Role]:
        """The roles read at this step. The loss (one element) is read every step."""
        on = set()
        for role in self.roles:
            every = self.role_every.get(role, self.every)
            if role is Role.LOSS or step < self.warmup or step % every == 0:
                on.add(role)
        return frozenset(on)
