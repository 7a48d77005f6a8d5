// jinja::render: runs a parsed chat template (jinja_parser.h) against a context with jinja2's
// runtime rules: a for loop's body gets a fresh scope each iteration (a `set` inside it does
// not leak out; namespaces carry state across), `if` shares its scope, macros see the scope
// they were defined in, loop.* and loop controls (break/continue) behave as in
// jinja2.ext.loopcontrols, and names resolve through the scopes, then the context, then
// transformers' globals.
//
// Guarantees: render() touches no shared mutable state (the tree is read-only), so concurrent
// renders of one tree are safe; any failure, raise_exception() included, is a TemplateError
// carrying the line of the innermost expression or statement that failed.
#pragma once

#include <string>

#include "engine/text/jinja_parser.h"
#include "engine/text/jinja_value.h"

namespace kvpipe::jinja {

// `context` is a Dict value: the template's variables.
std::string render(const Body& body, const Value& context);

}  // namespace kvpipe::jinja
