"""Driver boundaries shared by the sync and async twins: error translation, connection setup."""
