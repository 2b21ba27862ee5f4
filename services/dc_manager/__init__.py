"""The datacenter manager: turns the controller's intents into node commands (DESIGN.md section 4)."""
