"""The SSD tier's namespace names: each name an id of its own, given on first use.

Namespaces are few and keys are many, so a slot stores its namespace as a
small id (``SpillFile.nsid``) and this table turns the id back into the name,
its encoded form (the key index hashes it) and its zero-padded field (the
slot table's row holds it).  Ids are never reused while the tier is open.
"""

from __future__ import annotations

from kvtierd.spill import format as fmt


class NamespaceNames:
    """id <-> name, with each name's encoded and padded forms (the tier's lock held)."""

    def __init__(self) -> None:
        self.names: list[str] = []
        self.encoded: list[bytes] = []
        #: The name as the slot table's zero-padded field.
        self.padded: list[bytes] = []
        self.ids: dict[str, int] = {}

    def id_of(self, namespace: str) -> int:
        """The id of a namespace's name, given on first use."""
        i = self.ids.get(namespace)
        if i is None:
            i = self.ids[namespace] = len(self.names)
            self.names.append(namespace)
            self.encoded.append(namespace.encode())
            self.padded.append(self.encoded[i].ljust(fmt.NAME_BYTES, b"\0"))
        return i
