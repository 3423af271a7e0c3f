"""Auditing what hops compute: signed commitments, evidence, and checks anyone can run offline."""
