"""etude.v1 messages and service stubs, generated from proto/etude/v1 by tools/protogen.py."""
