"""The reference router: an HTTP front for engines, endpoints from events, replay after a failover."""
