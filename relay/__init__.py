"""The meshnode relay: forwards opaque frames between mesh members that cannot dial each other."""
