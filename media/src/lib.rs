//! caracal-media
