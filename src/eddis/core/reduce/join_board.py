"""Where the SMB modes' ranks say at which step they joined (``eddis.join()``,
:mod:`eddis.core.progress.join`): one counter per rank, created with the reducer."""


class JoinBoard:
    """One SMB counter per rank: ``1 +`` the reducer step at which that rank joined
    (relative to the value found at creation, so that counters an earlier reducer of
    the same name left behind do not count). Create it before the reducer's first
    collective: then every rank has read the bases before any rank can join."""

    def __init__(self, client, name, rank, size):
        self.rank = rank
        self.counters = [client.counter(f"{name}.joined.{r}") for r in range(size)]
        self.bases = [c.read() for c in self.counters]
        self.published = 0     # this rank's value (relative to its base)
        self.since = -1        # the last step of the previous join(): joins after it are this one's

    def publish(self, step):
        value = int(step) + 1
        self.counters[self.rank].fetch_add(value - self.published)
        self.published = value

    def join_steps(self):
        """Per rank, the step it joined at in the current join(), or None (not joined)."""
        steps = []
        for counter, base in zip(self.counters, self.bases):
            step = counter.read() - base - 1
            steps.append(step if step > self.since else None)
        return steps

    def everyone_joined_by(self, step):
        steps = self.join_steps()
        return all(s is not None and s <= step for s in steps)
