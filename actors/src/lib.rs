//! caracal-actors
pub mod pages;
pub mod radix;
