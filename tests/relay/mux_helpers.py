"""A channel mux whose records and application events a test takes apart (the relay tests' view of a link)."""

from __future__ import annotations

from meshnode.relaylink.mux import ChannelMux, MuxEvent, SendRecord


class Mux(ChannelMux):
    """A mux whose records for the peer and events for the application the test takes apart
    (the link carries both out in one pass): records wait for the way back."""

    def __post_init__(self) -> None:
        super().__post_init__()
        self.unsent: list[SendRecord] = []
        self.for_application: list[MuxEvent] = []

    def _sort_events(self) -> None:
        for event in self.take_events():
            (self.unsent if isinstance(event, SendRecord) else self.for_application).append(event)

    def records(self) -> list[SendRecord]:
        self._sort_events()
        records, self.unsent = self.unsent, []
        return records

    def application_events(self) -> list[MuxEvent]:
        self._sort_events()
        events, self.for_application = self.for_application, []
        return events
