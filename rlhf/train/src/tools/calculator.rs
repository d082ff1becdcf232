//! The built-in `calculator` tool: arithmetic on decimal numbers.
//!
//! Hand-written rather than a general expression crate (`evalexpr`, `meval`): the input is
//! whatever a policy under training writes, so the grammar is kept to numbers, `+ - * / ^ %`,
//! unary minus and parentheses, with a bound on its length and nesting, and nothing that names
//! a variable, calls a function or builds a string.

/// Longest expression accepted, in bytes.
pub const MAX_EXPRESSION_BYTES: usize = 256;

/// Deepest nesting of parentheses and unary signs accepted.
const MAX_DEPTH: usize = 32;

/// The value of `expression`, or what is wrong with it and where.
pub fn evaluate(expression: &str) -> Result<f64, String> {
    if expression.len() > MAX_EXPRESSION_BYTES {
        return Err(format!(
            "expected an expression of at most {MAX_EXPRESSION_BYTES} bytes, found {}",
            expression.len()
        ));
    }
    let mut parser = Parser { text: expression.as_bytes(), at: 0, depth: 0 };
    let value = parser.sum()?;
    parser.skip_spaces();
    if parser.at < parser.text.len() {
        return Err(format!(
            "unexpected `{}` at column {}",
            char::from(parser.text[parser.at]),
            parser.at + 1
        ));
    }
    if !value.is_finite() {
        return Err(format!("the result is not a finite number ({value})"));
    }
    Ok(value)
}

/// A result as the tool answers it: integers without a decimal point, others with up to 10
/// significant decimals.
pub fn format_number(value: f64) -> String {
    if value == value.trunc() && value.abs() < 1e15 {
        format!("{}", value as i64)
    } else {
        let text = format!("{value:.10}");
        text.trim_end_matches('0').trim_end_matches('.').to_owned()
    }
}

struct Parser<'a> {
    text: &'a [u8],
    at: usize,
    depth: usize,
}

impl Parser<'_> {
    fn skip_spaces(&mut self) {
        while self.text.get(self.at).is_some_and(u8::is_ascii_whitespace) {
            self.at += 1;
        }
    }

    fn peek(&mut self) -> Option<u8> {
        self.skip_spaces();
        self.text.get(self.at).copied()
    }

    fn deeper(&mut self) -> Result<(), String> {
        self.depth += 1;
        if self.depth > MAX_DEPTH {
            return Err(format!("expected at most {MAX_DEPTH} levels of nesting"));
        }
        Ok(())
    }

    /// `product (('+' | '-') product)*`
    fn sum(&mut self) -> Result<f64, String> {
        let mut value = self.product()?;
        while let Some(op @ (b'+' | b'-')) = self.peek() {
            self.at += 1;
            let rhs = self.product()?;
            value = if op == b'+' { value + rhs } else { value - rhs };
        }
        Ok(value)
    }

    /// `power (('*' | '/' | '%') power)*`
    fn product(&mut self) -> Result<f64, String> {
        let mut value = self.power()?;
        while let Some(op @ (b'*' | b'/' | b'%')) = self.peek() {
            let column = self.at + 1;
            self.at += 1;
            let rhs = self.power()?;
            if op != b'*' && rhs == 0.0 {
                return Err(format!("division by zero at column {column}"));
            }
            value = match op {
                b'*' => value * rhs,
                b'/' => value / rhs,
                _ => value % rhs,
            };
        }
        Ok(value)
    }

    /// `unary ('^' power)?` (right-associative)
    fn power(&mut self) -> Result<f64, String> {
        let base = self.unary()?;
        if self.peek() == Some(b'^') {
            self.at += 1;
            self.deeper()?;
            let exponent = self.power()?;
            self.depth -= 1;
            return Ok(base.powf(exponent));
        }
        Ok(base)
    }

    /// `'-' unary | '+' unary | atom`
    fn unary(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some(sign @ (b'-' | b'+')) => {
                self.at += 1;
                self.deeper()?;
                let value = self.unary()?;
                self.depth -= 1;
                Ok(if sign == b'-' { -value } else { value })
            }
            _ => self.atom(),
        }
    }

    /// `number | '(' sum ')'`
    fn atom(&mut self) -> Result<f64, String> {
        match self.peek() {
            Some(b'(') => {
                let open = self.at + 1;
                self.at += 1;
                self.deeper()?;
                let value = self.sum()?;
                self.depth -= 1;
                if self.peek() != Some(b')') {
                    return Err(format!("expected `)` closing the `(` at column {open}"));
                }
                self.at += 1;
                Ok(value)
            }
            Some(c) if c.is_ascii_digit() || c == b'.' => {
                let start = self.at;
                while self.text.get(self.at).is_some_and(|c| c.is_ascii_digit() || *c == b'.') {
                    self.at += 1;
                }
                let digits = std::str::from_utf8(&self.text[start..self.at]).unwrap_or_default();
                digits.parse::<f64>().map_err(|_| {
                    format!("expected a number at column {}, found `{digits}`", start + 1)
                })
            }
            Some(c) => Err(format!(
                "expected a number or `(` at column {}, found `{}`",
                self.at + 1,
                char::from(c)
            )),
            None => Err("expected a number or `(`, found the end of the expression".to_owned()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arithmetic_by_hand() {
        for (expression, value) in [
            ("1 + 2 * 3", 7.0),
            ("(1 + 2) * 3", 9.0),
            ("2 ^ 3 ^ 2", 512.0),
            ("-2 ^ 2", 4.0),
            ("10 / 4", 2.5),
            ("17 % 5", 2.0),
            ("-(3 - 5) * --2", 4.0),
            ("0.5 + .25", 0.75),
            ("  48 / 2 - 6  ", 18.0),
        ] {
            assert_eq!(evaluate(expression), Ok(value), "{expression}");
        }
        assert_eq!(format_number(18.0), "18");
        assert_eq!(format_number(2.5), "2.5");
        assert_eq!(format_number(1.0 / 3.0), "0.3333333333");
        assert_eq!(format_number(-7.0), "-7");
    }

    #[test]
    fn bad_expressions_say_what_and_where() {
        let err = |e: &str| evaluate(e).unwrap_err();
        assert!(err("1 +").contains("end of the expression"));
        assert!(err("2 * x").contains("column 5"), "{}", err("2 * x"));
        assert!(err("(1 + 2").contains("closing the `(` at column 1"));
        assert!(err("4 / (2 - 2)").contains("division by zero at column 3"));
        assert!(err("1 2").contains("unexpected `2` at column 3"));
        assert!(err("1.2.3").contains("1.2.3"));
        assert!(err("10 ^ 400").contains("not a finite number"));
        assert!(err(&"(".repeat(40)).contains("nesting"));
        assert!(err(&"-".repeat(40)).contains("nesting"));
        assert!(err(&"1+".repeat(200)).contains("at most 256 bytes"));
        assert!(err("import os").contains("column 1"));
    }
}
