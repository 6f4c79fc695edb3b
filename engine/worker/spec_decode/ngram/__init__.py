"""N-gram (prompt lookup) speculator."""
