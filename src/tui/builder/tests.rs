//! The builder's pure update and its drawing, without a terminal.
