"""The node side of the relay: relay client, sealed relay channels, relayed peer links."""
