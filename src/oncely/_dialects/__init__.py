"""Dialects: the SQL (and later Lua) of each store as pure text builders and row parsers."""
